"""gearshift.agents.emulator"""
