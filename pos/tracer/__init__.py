"""Attach uprobes to a process's GPU driver library and record what it does into the store."""
