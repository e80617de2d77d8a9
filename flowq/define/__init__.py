"""What users declare: steps, pipelines and tasks, the FlowQ registry, retry policies, enqueue
options, queue limits, schedules and workflow shapes. No SQL and no I/O: nothing here imports
the layers above (enqueueing, the database, the worker, operations, CLI, dashboard), except
`Task.enqueue` reaching the enqueueing layer when it is called (tests/unit/test_imports.py)."""
