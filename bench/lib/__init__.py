"""What the benches share: launching a job on a throw-away log (launch.py), sampling processes'
CPU (sampling.py), statistics (stats.py), and results: JSON, tables and plots (results.py)."""
