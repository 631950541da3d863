"""systemd: service notifications, journald logging, the unit and its installation."""
