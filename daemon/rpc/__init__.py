"""gRPC servicers: thin adapters that check a request, call the domain object and map
its typed errors to status codes. Nothing here decides anything.
"""
