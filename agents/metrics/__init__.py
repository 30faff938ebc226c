"""gearshift.agents.metrics"""
