"""Pure values every process can hold: the layout of a run, its options, the entrypoint.

Nothing here starts a process or opens a socket; ``topology`` only reads what the machine offers.
A front door turns the user's arguments into these values, and every check of user input happens
while they are built, before anything runs.
"""
