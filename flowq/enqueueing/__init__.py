"""Enqueueing in the caller's transaction: the pure preparation of an enqueue or a signal
(`prepare`, `signals`, shared by sync and async) and its execution (`sync`, `aio`).

Not `flowq.enqueue`: that name is the public function, and a subpackage of that name would
replace it as an attribute of `flowq` as soon as it is imported.
"""
