"""High availability: the lease table, the elector (PostgreSQL lease or a lone SQLite
controller), and `Leadership`, the gate that serves only while this controller leads."""
