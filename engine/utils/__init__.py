"""Plain helpers with no engine imports: token trees as parent lists (``tree``), host-to-device
copies (``transfer``), device choice (``devices``), the start-up heap (``heap``), fault hooks
(``faults``)."""
