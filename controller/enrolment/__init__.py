"""Admitting hosts: bootstrap tokens, enrolment rules and admission, the certificate
authority that signs host certificates, the enrolment service and its tables."""
