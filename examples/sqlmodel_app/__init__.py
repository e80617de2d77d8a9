"""SQLModel (in a sync FastAPI app): a Session class with flowq's `SessionMixin`, so that
`session.enqueue(...)` joins the request's transaction. See README.md here and
docs/frameworks.md."""
