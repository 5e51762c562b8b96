"""Control-plane logic shared by the REST API, the dashboard and the Celery tasks.

Functions take ``session`` first and keyword arguments after; they flush but leave the commit to the caller,
so a route or a task decides what one transaction holds.
"""
