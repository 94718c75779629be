"""Several processes, one memory: the parts only shared mode runs.

    producer (a gateway)                               worker (python -m workers)
      slots.ProducerSlots  its own outbox folder         inbox.InboxSource  claims under lease
      sinks.ForwardSink    batches into the inbox ──►    (the writer commits them)
      recall.RemoteRecaller / ResultsPoller ◄──────►     recall.RecallServer
"""
