"""`python -m gearshift.gateway …`: the same as `gearshift gateway …`."""

from gearshift.gateway.cli import gateway

if __name__ == "__main__":
    gateway()
