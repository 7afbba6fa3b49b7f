from twisted.application.service import ServiceMaker

Dallal = ServiceMaker(
    "Dallal", "dallal.tap", "A publish/subscribe message broker.", "dallal"
)
