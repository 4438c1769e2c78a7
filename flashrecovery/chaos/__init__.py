"""`flashrecovery chaos`: a job run under a seeded random schedule of faults, then checked.

``schedule`` draws the faults (pure), ``verdict`` judges the run from its log and the ranks'
final states, ``cli`` runs the reference and the chaos job and prints the verdict.
"""
