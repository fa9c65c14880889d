"""Transport-level benchmark: celery-redis-lua side by side with the brokers Celery users pick.

Run ``python -m scripts.bench`` from the project root (``make bench-all``); ``--help``
lists the knobs. Modules: peers (what is measured), probes (server cost), kombu_level,
celery_level (+ app, the Celery app the workers run), broker_mechanics (a
celery-benchmark-style load), report (medians, ratios, table, chart, JSON).
"""
