# The isthmus-worker binary (worker/*.cc at this level): library isthmus_worker for the
# round loop, progress, telemetry and settings (tests link it), and the executable around it.
add_library(isthmus_worker STATIC
  ${CMAKE_CURRENT_LIST_DIR}/round_loop.cc
  ${CMAKE_CURRENT_LIST_DIR}/generation.cc
  ${CMAKE_CURRENT_LIST_DIR}/live_params.cc
  ${CMAKE_CURRENT_LIST_DIR}/progress.cc
  ${CMAKE_CURRENT_LIST_DIR}/telemetry.cc
  ${CMAKE_CURRENT_LIST_DIR}/worker_config.cc)
target_include_directories(isthmus_worker PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(isthmus_worker
  PUBLIC isthmus_model isthmus_comm isthmus_data isthmus_codec isthmus_common CLI11::CLI11
  PRIVATE nlohmann_json::nlohmann_json spdlog::spdlog)

add_executable(isthmus-worker ${CMAKE_CURRENT_LIST_DIR}/main.cc)
target_link_libraries(isthmus-worker PRIVATE isthmus_worker nlohmann_json::nlohmann_json)
install(TARGETS isthmus-worker RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
