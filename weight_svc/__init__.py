"""The weight service: a versioned, chunked, checksummed checkpoint store (see app.py)."""
