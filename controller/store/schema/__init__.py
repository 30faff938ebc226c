"""gearshift.controller.store.schema"""
