"""The simulator against measurements: calibration on this machine, the paper's figures."""
