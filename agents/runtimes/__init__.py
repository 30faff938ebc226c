"""gearshift.agents.runtimes"""
