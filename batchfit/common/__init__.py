"""What every entry point shares, below tracking/, train/ and search/: config errors that name
the key and the fix, the console that says them with the exit status, the stop a signal asked
for, and passwords masked wherever text leaves the process."""
