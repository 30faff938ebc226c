"""gearshift.controller"""
