"""Command-line interface: thin commands that wire roles to transports and format results."""
