"""gearshift.policies"""
