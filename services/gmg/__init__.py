"""The GMG state service: the only writer of GMG structure and live device state (DESIGN §3)."""
