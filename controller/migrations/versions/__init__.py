"""gearshift.controller.migrations.versions"""
