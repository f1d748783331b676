"""SQLAlchemy 2.0 models and queries over one SQLite file."""
