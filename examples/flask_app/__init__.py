"""Flask + Flask-SQLAlchemy: an order and its receipt job committed by one `db.session`. See
README.md here and docs/frameworks.md."""
