"""gearshift.agents"""
