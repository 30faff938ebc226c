"""gearshift.cli"""
