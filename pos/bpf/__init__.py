"""eBPF C programs (bcc text), one per probe family; no Python logic lives here."""
