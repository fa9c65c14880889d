"""Sends tasks.add every PRODUCER_INTERVAL seconds (default 5) to the broker named by
CELERY_BROKER_URL (tasks.py builds the app from the same variable)."""

import itertools
import os
import time

from tasks import add

broker_url = os.environ["CELERY_BROKER_URL"]
interval = float(os.environ.get("PRODUCER_INTERVAL", "5"))
print(f"producer: sending tasks.add every {interval:g} s to {broker_url}", flush=True)
for n in itertools.count():
    result = add.delay(n, n)
    print(f"producer: sent add({n}, {n}) as {result.id}", flush=True)
    time.sleep(interval)
