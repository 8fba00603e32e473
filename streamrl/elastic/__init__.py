"""Elastic generation: generator instances added and removed during a run.

  config.py      the `elastic.*` settings
  policy.py      the rule (pure: measured stage times in, a decision out)
  controller.py  ElasticGeneration: the rule applied to the live service

The simulator replays the same rule (streamrl/sim/elastic.py); nothing here
imports the simulator.
"""
