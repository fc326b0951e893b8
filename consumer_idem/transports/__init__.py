"""Broker transports (Kafka, RabbitMQ) around one shared settle path (``settle.py``).

Each transport module imports its broker client; nothing outside this package and the
integrations does.
"""
