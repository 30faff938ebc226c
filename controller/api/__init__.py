"""The gRPC surface: the control service (reads and actions), the server's assembly,
interceptors, authentication, paging and the validation of what clients send."""
