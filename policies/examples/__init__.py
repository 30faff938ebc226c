"""gearshift.policies.examples"""
