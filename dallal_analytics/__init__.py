"""
Spark analytics over Dallal broker logs; spark/report.py is the command.
"""
