"""``python -m celery_redis_lua``: the operator's command line (the ``celery-redis-lua`` script)."""

from .tools.cli import main

if __name__ == "__main__":
    main()
