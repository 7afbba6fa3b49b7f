from twisted.application.service import ServiceMaker

Dallal = ServiceMaker(
    "Dallal", "dallal.server.tap", "A publish/subscribe message broker.", "dallal"
)
