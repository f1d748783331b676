"""Tests of the scheduled snapshots (pos/cron/)."""
