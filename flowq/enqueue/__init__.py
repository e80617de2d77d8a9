"""Enqueueing in the caller's transaction: the options, their pure preparation (shared by sync and async), and their execution."""
