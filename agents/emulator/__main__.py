"""`python -m gearshift.agents.emulator`: the same command as `gearshift emulate`."""

from gearshift.agents.emulator.cli import emulate

if __name__ == "__main__":
    emulate(prog_name="gearshift emulate")
