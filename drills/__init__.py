"""Drills against a running fleet from outside it: open-loop load (drills/load.py) with its reports, and the fault
drill (drills/fault.py). Import the module you need: the package loads nothing, so `tideflow` starts without the
openai client."""
