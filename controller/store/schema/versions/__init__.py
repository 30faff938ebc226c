"""gearshift.controller.store.schema.versions"""
