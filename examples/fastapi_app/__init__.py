"""FastAPI + SQLAlchemy AsyncSession: a sign-up that writes a user and enqueues its pipeline in
one transaction. See README.md here and docs/frameworks.md."""
