"""The chaos suite (``kvpool chaos``): real processes, injected faults, recorded histories and
checkers that prove nothing wrong was read and nothing committed was lost."""
