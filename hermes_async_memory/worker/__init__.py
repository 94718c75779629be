"""The worker process: ``hermes-memory worker`` and ``python -m workers`` (from a checkout).

    main.py   options, signals, the run loop, exit codes
    http.py   GET /healthz and GET /metrics (the metrics extra: prometheus-client)
    demo.py   --demo: a short scripted load on the embedded default
"""
