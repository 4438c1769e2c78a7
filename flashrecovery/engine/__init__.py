"""The engine: the pure decide step over a job's records, its detectors, and the loop that feeds
it from the log and appends its decisions."""
