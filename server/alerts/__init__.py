"""Alerts: rules evaluated on metric ingest, status changes and a stall check; signed webhook deliveries.

``rules`` decides when a rule fires (once per episode, state in ``alert_states``); ``webhooks`` stores
endpoints, guards their URLs (SSRF), and sends deliveries from the Celery task ``asyncrl.deliver_webhook``.
"""
