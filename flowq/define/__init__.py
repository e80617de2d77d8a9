"""What users declare: steps, pipelines, the FlowQ registry, retry policies, queues, schedules and workflow shapes; no SQL, no I/O, nothing imported from the layers above."""
