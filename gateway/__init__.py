"""gearshift.gateway"""
