"""gearshift.common: what every package shares and nothing else owns.

Errors, the controller endpoints and TLS credentials as clients use them,
identity constants, the deployment spec and the engine catalog. It imports no
other gearshift package (tests/unit/test_layering.py checks it).
"""
