"""Reading a job's log after the fact or as it grows: the replayer and its command, what-if,
the timeline and its plot, `events`, and the check of the hash chains. Readers only: nothing
here writes to a log."""
