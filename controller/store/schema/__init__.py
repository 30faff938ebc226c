"""gearshift.controller.migrations"""
